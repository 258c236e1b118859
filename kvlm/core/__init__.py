"""What every other part of kvlm builds on, importing nothing else of kvlm: a model's configuration
(`config.ModelConfig`), what a family is and the registry the families fill (`family`), the layer kinds, RoPE
(`rope`), batches (`batch`) and kvlm's errors (`errors`). Dependencies point one way: core <- memory and model <-
families <- loader <- runtime (context, engine) <- server, cli (tests/units/test_import_graph.py holds them to it)."""
