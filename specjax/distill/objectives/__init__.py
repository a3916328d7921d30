"""The built-in distillation objectives (`specjax.distill.objective`), one module per family: `draft_model`
("truncate", "fresh", "checkpoint"), `parallel` (PARD), `eagle` ("eagle_head"), `dflash` ("dflash_head")."""
