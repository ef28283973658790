"""The P of 3D: the stage split, the pipeline module, and the schedules with their registry
(`dsx3d.pipeline.registry`: name -> check, bubble and in-flight model, planner options, installation)."""
