"""Eager patching: each matched module's forward replaced by the fused op (mlp_fuser.patch is the function)."""
