"""What the integration halves share with their fast halves: the fast modules' fixtures they use (pytest finds
fixtures named in a conftest for every test of this folder)."""

from fast.test_evals import lm_eval_model  # noqa: F401  (tests/fast/test_evals.py)
from fast.test_generate import run  # noqa: F401  (tests/fast/test_generate.py)
from fast.test_hf import tokenizer_file  # noqa: F401  (tests/fast/test_hf.py)
from fast.test_tokenstore import tok_file  # noqa: F401  (tests/fast/test_tokenstore.py)
