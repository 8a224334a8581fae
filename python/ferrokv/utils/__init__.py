"""vLLM's ``vllm.utils`` names that scripts written for vLLM import: ``FlexibleArgumentParser``
(its home is ``ferrokv.utils.argparse_utils``, vLLM's ``vllm.utils.argparse_utils``)."""

from ferrokv.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
