"""Running a session on its provider's device for timing.

``session.run`` with numpy feeds copies every input to a GPU and every output back on each call:
GPT-2's logits alone are 26 MB a run, more time than some of its layers take, and the same for
both models of a comparison, so the copies would dilute every ratio toward 1. On a GPU provider
the feeds are copied to the device once and the outputs bound there, so a timed run is the
model's own work. The CPU provider runs as ``session.run`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnxruntime as ort

# onnxruntime's name for the memory each GPU provider computes in.
_DEVICE_MEMORY = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda"}


def binds_on_device(session: ort.InferenceSession) -> bool:
    """Whether ``runner`` keeps this session's inputs and outputs in device memory."""
    return session.get_providers()[0] in _DEVICE_MEMORY


class _DeviceRun:
    """One run with inputs already in device memory and outputs left there."""

    def __init__(self, session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> None:
        device = _DEVICE_MEMORY[session.get_providers()[0]]
        self.session = session
        self.binding = session.io_binding()
        # Held here as long as the binding, which points into their memory.
        self.inputs = {n: ort.OrtValue.ortvalue_from_numpy(a, device, 0) for n, a in feeds.items()}
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        for output in session.get_outputs():
            self.binding.bind_output(output.name, device, 0)

    def __call__(self) -> None:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()  # kernels are queued on a stream: wait for them


def runner(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> Callable[[], None]:
    """A call that runs ``session`` once on ``feeds`` and returns when the device is done."""
    if binds_on_device(session):
        return _DeviceRun(session, feeds)
    plain = dict(feeds)

    def run_on_host() -> None:
        session.run(None, plain)

    return run_on_host
