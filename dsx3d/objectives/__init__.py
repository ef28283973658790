"""Training objectives: what the engine is given to train, instead of branches in the faces.

Each objective says what its micro-batches carry, what the last stage computes from them (the loss, and the
statistics its metrics need), which metrics it logs, and what it needs of a reference model. `dsx3d.Trainer`
picks one for its class (a TRL SFTTrainer trains SFT), `dsx3d train` one for its recipe's data.
"""

from dsx3d.objectives.base import Objective
from dsx3d.objectives.dpo import DirectPreference
from dsx3d.objectives.language_model import LanguageModeling
from dsx3d.objectives.sft import SupervisedFineTuning

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (LanguageModeling, SupervisedFineTuning, DirectPreference)}

__all__ = ["OBJECTIVES", "DirectPreference", "LanguageModeling", "Objective", "SupervisedFineTuning"]
