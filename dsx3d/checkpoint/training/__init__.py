"""Training checkpoints: what DeepSpeed writes during a run (`checkpointer`), its layout on disk
(`disk_format`, `item_locations`), what a resume may carry over (`resume`) and resharding through DeepSpeed's
universal format (`universal`)."""
