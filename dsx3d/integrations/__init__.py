"""Faces of the engine for the Hugging Face ecosystem: a `transformers.Trainer` drop-in (`dsx3d.Trainer`) and
accelerate launch configs (`dsx3d accelerate-config`). Both build the engine through `dsx3d.engine.build_engine`.
"""
