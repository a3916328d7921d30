import jax
import torch

jax.config.update("jax_numpy_rank_promotion", "raise")
# torch's reference forwards compete with XLA's threads for the 2 cores; one thread keeps them fast.
torch.set_num_threads(1)
