"""The statistics a table counts on the device, without a host wait: one int64 counter
per name, in this order. A table keeps a (NUM_COUNTED,) tensor; a group of tables a
(tables, NUM_COUNTED) one that the grouped kernels add into at table * NUM_COUNTED + name.
"""
import triton.language as tl

COUNTED = ("lookups", "hits", "inserts", "rejections", "evictions", "admissions", "admission_rejections")
LOOKUPS, HITS, INSERTS, REJECTIONS, EVICTIONS, ADMISSIONS, ADMISSION_REJECTIONS = range(len(COUNTED))
NUM_COUNTED = len(COUNTED)

# the same, for kernels (which read only constexpr globals)
K_LOOKUPS, K_HITS, K_INSERTS, K_REJECTIONS, K_EVICTIONS, K_ADMISSIONS, K_ADMISSION_REJECTIONS = (
    tl.constexpr(i) for i in range(NUM_COUNTED)
)
K_NUM_COUNTED = tl.constexpr(NUM_COUNTED)
