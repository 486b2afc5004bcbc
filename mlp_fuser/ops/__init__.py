"""The mlp_fuser:: torch.library ops, one module per op family: schema, checks, fake, autograd, autocast."""
