"""pytest settings for running the notebooks with nbmake (`pytest --nbmake notebooks`).

nbclient waits 60 s for a new kernel to answer, and nbmake has no option for it; on a
loaded 2-core CI machine, with the other xdist worker's kernel compiling, one start once
took longer (CI, 2026-12-01: "Kernel didn't respond in 60 seconds"). The kernels get 300 s.
"""

import nbclient
import nbmake.nb_run
from traitlets import Integer


class _PatientNotebookClient(nbclient.NotebookClient):
    startup_timeout = Integer(300).tag(config=True)


nbmake.nb_run.NotebookClient = _PatientNotebookClient
