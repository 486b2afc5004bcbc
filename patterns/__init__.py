"""The pattern registry (shipped as ``mlp_fuser.patterns``): one small file per family of MLP pattern."""
