"""Process groups, autograd collectives and tensor-parallel layers."""
