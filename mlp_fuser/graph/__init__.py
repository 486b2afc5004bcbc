"""torch.compile's side: the FX pass that fuses matched MLPs, the backend, tensor-parallel sharding."""
