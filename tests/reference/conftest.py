"""Make the source tree's ``reference`` importable when tox runs pytest without installing it.

Imports nothing but the stdlib: the ``reference`` tox env has no torch, transformers or xtokspec.
"""

import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
