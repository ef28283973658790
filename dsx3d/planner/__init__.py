"""`dsx3d plan --auto`: the search over layouts, ZeRO stages, schedules and batch shapes, ranked by the estimator."""
