"""``python -m megatron_ext.cluster`` — see :mod:`megatron_ext.cluster.cli`."""
import sys

from megatron_ext.cluster.cli import main

sys.exit(main())
