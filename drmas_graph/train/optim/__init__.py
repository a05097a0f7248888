"""The update: `ModelUpdater` (one optimizer step per trained model on its agents' samples) and `LoraUpdater`
(one adapter per agent), both `Updater`s; the GRPO math they use (`advantages`, `losses`, `offpolicy`), logprobs
(`_logprobs`, `_old_logprobs`), supervised steps on demonstrations (`supervised`: the warm start), prefix-shared packing (`_packing`), the reference model (`_reference`) and their
metrics (`_update_metrics`).

The names below are what `train.loop` uses (tests/test_layout.py checks that it uses nothing else of this
package); the modules starting with `_` are this package's own.

May import: `train.engines` and the layers below train (shared modules, engine); never `train.loop`.
"""

from drmas_graph.train.optim._old_logprobs import with_trainer_logprobs
from drmas_graph.train.optim._update_metrics import AgentUpdateMetrics, UpdateMetrics
from drmas_graph.train.optim._updater import Updater
from drmas_graph.train.optim.advantages import AdvantageStats, compute_advantages
from drmas_graph.train.optim.lora import LoraUpdater, attach_adapters, build_updater, load_adapters, save_for_sync
from drmas_graph.train.optim.offpolicy import CorrectionStats, OffPolicyCorrection
from drmas_graph.train.optim.supervised import SupervisedUpdater
from drmas_graph.train.optim.update import ModelUpdater, set_attn_implementation

__all__ = ["AdvantageStats", "AgentUpdateMetrics", "CorrectionStats", "LoraUpdater", "ModelUpdater", "OffPolicyCorrection",
           "UpdateMetrics", "Updater", "attach_adapters", "build_updater", "compute_advantages", "load_adapters",
           "save_for_sync", "set_attn_implementation", "SupervisedUpdater", "with_trainer_logprobs"]
