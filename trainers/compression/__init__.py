"""Compression for the low-communication methods, one idea per module.

Every compressor turns a float tensor into a flat ``torch.uint8`` tensor, the bytes that really cross the network
(the methods all-gather them as uint8), and decodes it back from those bytes plus the tensor shape, which every rank
knows. Anything else the receiver needs (bucket scales, lookup tables) travels inside the bytes, so
``payload_nbytes(shape)`` is the exact size on the wire and lets a receiver split a gathered buffer.

Building blocks, each usable alone:

- ``cast``: the fp16 / bf16 / fp32 dtypes OpenDiLoCo's all-reduce sums in (``CAST_DTYPES``)
- ``shapes``: a tensor seen as a matrix (``matrix_shape``) and a dimension cut into blocks (``chunk_length``)
- ``bitpack``: unsigned integers of any width packed into bytes, low bits first
- ``quantize``: int-k quantization with per-bucket max-abs scaling (k in {2, 4, 8}), and SparseLoCo's statistical
  quantizer with its lookup table
- ``sparsify``: CocktailSGD's deterministic rotating random mask, top-k selection, compact index encoding
- ``lowrank``: PowerSGD's warm-started power iteration and the spectral-energy rank estimator DiLoCoX adapts with
- ``powersgd``: the shared-basis low-rank exchange whose factors add (DiLoCoX's ``--exchange reduce``)
- ``dct``: the chunked orthonormal DCT-II DeMo sends the top-k coefficients of
- ``error_feedback``: what compression dropped, added back to the next tensor

and the composites the methods use: ``compressors`` (``SparseQuantizeCompressor``, CocktailSGD's chain, and
``LowRankQuantizeCompressor``, DiLoCoX's C_Q o C_L) and ``chunked_topk`` (SparseLoCo's ``ChunkedTopK``).

Everything stays in torch on the tensor's device. Multi-byte layouts are built from shifts and masks, so the bytes
do not depend on the host's endianness (fp16/fp32 values excepted: raw little-endian memory wherever this runs).
"""
