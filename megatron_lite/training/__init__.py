"""Trainer loop (trainer.py) and its parts: model setup, the step (step.py), evaluation, and
reporting (throughput/MFU, memory, MoE metrics); stop signals and the save policy, optimizer and
LR schedule, logging (checkpoints themselves: megatron_lite/checkpoint/)."""
