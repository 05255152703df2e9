"""data_plane/speed.py's DecodeFit: a decode step's time against its batch size, as the
worker reports it for routing (tests/gateway/test_routing_balance.py has the router's side)."""

from __future__ import annotations

import pytest

from data_plane.speed import DecodeFit


def test_the_decode_fit_follows_the_batch_size_or_stays_flat() -> None:
    fit = DecodeFit(alpha=0.1)
    assert fit.coefficients() == (0.0, 0.0)
    for num_requests in [*range(1, 25), *range(24, 0, -1)] * 3:
        fit.observe(num_requests, 0.002 + 0.0007 * num_requests)
    assert fit.coefficients() == pytest.approx((0.002, 0.0007))
    one_size = DecodeFit(alpha=0.1)
    for _ in range(20):  # one batch size: no slope to fit, the time taken as proportional
        one_size.observe(24, 0.0196)  # (idle, flat at 19.6 ms, it drew nothing: served)
    assert one_size.coefficients() == pytest.approx((0.0, 0.0196 / 24))
    single = DecodeFit(alpha=0.1)
    for _ in range(20):  # one request at a time: flat (proportional would make it look
        single.observe(1, 0.02)  # half as fast at two, and a slower worker drew its requests)
    assert single.coefficients() == pytest.approx((0.02, 0.0))
    falling = DecodeFit(alpha=0.1)
    for num_requests in range(1, 30):  # noise on a flat device: never a negative slope
        falling.observe(num_requests, 0.01 - 0.0001 * num_requests)
    base_s, per_request_s = falling.coefficients()
    assert per_request_s == 0.0 and 0.007 < base_s < 0.01
    with pytest.raises(ValueError, match="alpha"):
        DecodeFit(alpha=0.0)
