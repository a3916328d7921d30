"""Helpers shared by the tests: tiny random models and perturbed drafts with their engine runners
(`engine`, `layer_skip`, `eagle`, `ngram`, `trees`), chi-square and exact-enumeration helpers (`stats`,
`engine.exact_distribution`), tiny Hugging Face checkpoints, tokenizers and GGUF files (`tiny_hf`,
`tokenizers`, `gguf`, `distill`, `cli`), and the multi-device worker runner and its worker scripts
(`multidevice`, `mesh_worker`, `distill_mesh_worker`).

Tests import shared code from here, never from each other: a test module holds only what it alone uses.
"""
