"""Attention TP of different sizes on real ``sglang.launch_server`` processes behind
SGLang's router (issue 29, item 1), for a CUDA host with 2 GPUs or more: SGLang's CPU
engine cannot run TP > 1 (its TP group builds a PyNcclCommunicator), so on a CPU host
these are skipped and test_sglang_across_tp.py runs the same shapes on SGLang's own classes per
rank. The tiny Llama has 2 KV heads: TP 2 holds one per rank. Greedy outputs through the
pair must equal a plain server's, token for token; no room left, ``kvstate audit``
clean."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import scaled, wait_for

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_e2e, pytest.mark.timeout(scaled(900))]


def _gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except ImportError:
        return 0


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (SGLang's CPU engine runs TP 1)")
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_tp_sizes_that_differ_give_a_plain_servers_tokens(
    tmp_path: Path, prefill_tp: int, decode_tp: int
) -> None:
    from kvstate.testing.process import RedisProcess
    from tests.integrations.sglang_model import build, prompt
    from tests.integrations.sglang_servers import (
        Deployment,
        audit,
        decode,
        generate,
        launch,
        prefill,
        router,
    )

    redis_proc = RedisProcess(tmp_path, unix_socket=False, port="auto")
    redis_proc.start()
    model = build(tmp_path / "model", seed=1)
    logdir = tmp_path / "logs"
    logdir.mkdir()
    url = redis_proc.tcp_url
    plain = launch("plain", model, logdir, url)
    p, bootstrap = prefill(model, logdir, url, "--tp", str(prefill_tp))
    d = decode(model, logdir, url, "--tp", str(decode_tp))
    procs = [plain, p, d]
    try:
        for s in procs:
            s.start()
        bootstrap = int(p.argv[p.argv.index("--disaggregation-bootstrap-port") + 1])
        r = router(p, bootstrap, d, logdir)
        procs.append(r)
        r.start()
        pd = Deployment(url, logdir, {"a": model}, plain, p, bootstrap, d, r)
        for n in (5, 40, 150):
            text = prompt(n)
            assert generate(r.url, text, 12) == generate(plain.url, text, 12), n
        assert wait_for(lambda: pd.room_keys() == [], 30), pd.room_keys()
        result = audit(url)
        assert result.returncode == 0 and "clean" in result.stdout, result.stdout
    finally:
        for s in reversed(procs):
            s.stop()
        redis_proc.stop()
