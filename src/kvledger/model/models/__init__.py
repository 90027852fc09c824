"""One file per model family on the shared layers (``model/layers/``); ``registry.py`` maps HF
``model_type`` names to them. Adding a family: its file, its registry line, its parity test row
(tests/unit/test_families.py)."""
