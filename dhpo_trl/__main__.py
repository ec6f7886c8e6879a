"""`python -m dhpo_trl`: the embedded CPU default (DHPO-E on a warm-started tiny model), see `dhpo_trl.demo.embedded`."""

import os
import sys

# Before any Hugging Face import: the embedded run is offline by construction.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from dhpo_trl.demo.embedded import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
