"""Trainer loop, optimizer and LR schedule, gradient finalization, logging."""
