"""DeepSeek-V3.2 / GLM-5 sparse-attention (DSA) model math, shared by every runtime.

Pure torch over tensors on any device; nothing here imports vLLM or transformers.

* ``config``    -- ``DSAConfig.from_hf``: both config spellings (transformers', vLLM's) read
  into one frozen dataclass; index groups (a full indexer layer and the shared layers after it).
* ``attention`` -- MLA over latent rows: the row of a token, the absorbed query, attention over
  gathered rows, the value expansion.
* ``indexer``   -- the DSA indexer: key normalisation, scores, causal top-k selection.
* ``make_checkpoint`` -- seeded tiny checkpoints made by transformers' own classes (imports
  transformers only when called).
"""

from hisparse.models.dsa.config import DSAConfig, DSAConfigError

__all__ = ["DSAConfig", "DSAConfigError"]
