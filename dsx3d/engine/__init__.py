"""The engine: one builder for every face (`build_engine`, `Engine3D`), and the DeepSpeed internals it adjusts
(the bf16 optimizer's norm on a stage without gradients, the fp16 wrappers' initialising step); a preference
objective's reference pass (`reference`), an objective's last-stage loss under `dsx3d train` (`stage_loss`, over the
vocabulary shard of `vocab_shard`) and DPO's step and evaluation there (`preference_run`)."""

from dsx3d.engine.builder import Engine3D, MicroBatch, build_engine

__all__ = ["Engine3D", "MicroBatch", "build_engine"]
