"""The recipe: its typed schema (`schema`), the DeepSpeed JSON it generates (`ds_config`), the model's HF config
(`hf_config`) and the checks that run before any process starts (`checks`). Pure: no processes, no DeepSpeed."""
