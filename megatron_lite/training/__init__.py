"""Trainer loop, stop signals and the save policy, optimizer and LR schedule, gradient
finalization, logging (checkpoints themselves: megatron_lite/checkpoint/)."""
