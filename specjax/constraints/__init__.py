"""Constrained (structured) output: regular expressions and JSON schemas compiled on the host into token
tables (`compiler`), applied on device as a mask on the target's and the draft's logits (`mask`)."""
