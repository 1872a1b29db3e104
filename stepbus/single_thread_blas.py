"""One BLAS thread per process, set before numpy is imported (users can still override).

Five numpy processes with threaded BLAS on two cores ran 12x slower in our measurements: each
process's BLAS threads fought the others' for the same cores.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
