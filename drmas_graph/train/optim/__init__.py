"""The update: `update.ModelUpdater` (one optimizer step per trained model on its agents' samples) and
`lora.LoraUpdater` (one adapter per agent), both `_updater.Updater`s; the GRPO math they use (`advantages`,
`losses`, `offpolicy`), logprobs (`_logprobs`, `_old_logprobs`), prefix-shared packing (`_packing`), the reference
model (`_reference`) and their metrics (`_update_metrics`).

May import: `train.engines` and the layers below train (shared modules, engine); never `train.loop`.
"""
