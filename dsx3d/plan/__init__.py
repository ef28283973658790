"""Where ranks and layers go: the dp x tp x pp layout (`layout`), the pipeline's stage bounds (`stages`), the
layout search (`search`) and its drawing (`draw`). Pure: no processes, no DeepSpeed."""
