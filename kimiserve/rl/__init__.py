"""Zero-mismatch RL: the batch-invariant forward (engine and trainer), the trainer, weight sync, GRPO."""


def __getattr__(name):
    if name == "PolicyTrainer":
        from kimiserve.rl.trainer import PolicyTrainer

        return PolicyTrainer
    if name in ("sync_weights", "save_weights", "load_weights"):
        from kimiserve.rl import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(name)
