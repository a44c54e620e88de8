"""The benchmarks' emulated network (bench/delayline.py): bytes arrive whole, in order, late.

The benchmarks' ratios at 1 and 5 ms RTT are only as good as this proxy, so its contract is
tested here with real sockets on loopback: every byte of both directions arrives in order, a
1-byte exchange takes at least the set round trip, bulk data is not capped, and only loopback
upstreams are accepted.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from bench.delayline import DelayLine, _echo_server, measure_rtt


def test_bytes_arrive_whole_and_in_order_both_ways():
    echo, addr = _echo_server()
    line = DelayLine(addr, 0.002, calibrate=False).start()
    try:
        payload = os.urandom(3 << 20)
        with socket.create_connection(line.address) as s:
            got = bytearray()

            def receive() -> None:
                while len(got) < len(payload):
                    data = s.recv(1 << 20)
                    if not data:
                        return
                    got.extend(data)

            t = threading.Thread(target=receive)
            t.start()
            for i in range(0, len(payload), 65536):  # echo mirrors each piece back
                s.sendall(payload[i:i + 65536].replace(b"B", b"b"))
            t.join(30)
        assert bytes(got) == payload.replace(b"B", b"b")
    finally:
        line.close()
        echo.close()


@pytest.mark.parametrize("rtt", [0.002, 0.005])
def test_round_trip_is_at_least_the_setting(rtt):
    echo, addr = _echo_server()
    line = DelayLine(addr, rtt, calibrate=False).start()
    try:
        got = measure_rtt(line.address, count=20)
        # never early; late by the proxy's own handoff, generous for a loaded CI machine
        assert rtt <= got < rtt + 0.005, got
    finally:
        line.close()
        echo.close()


def test_zero_delay_streams_without_a_cap():
    echo, addr = _echo_server()
    line = DelayLine(addr, 0.0).start()
    try:
        with socket.create_connection(line.address) as s:
            start = time.perf_counter()
            s.sendall(b"B%d\n" % (64 << 20))
            n = 0
            while (data := s.recv(1 << 20)):
                n += len(data)
        assert n == 64 << 20
        assert n / (time.perf_counter() - start) > 50 << 20  # far above any cap; loopback is ~1 GiB/s
    finally:
        line.close()
        echo.close()


def test_rate_limit_caps_a_stream():
    echo, addr = _echo_server()
    line = DelayLine(addr, 0.001, rate=8 << 20, calibrate=False).start()
    try:
        with socket.create_connection(line.address) as s:
            start = time.perf_counter()
            s.sendall(b"B%d\n" % (8 << 20))
            n = 0
            while (data := s.recv(1 << 20)):
                n += len(data)
            elapsed = time.perf_counter() - start
        assert n == 8 << 20
        assert elapsed > 0.8  # 8 MiB at 8 MiB/s, less the one-piece burst
    finally:
        line.close()
        echo.close()


def test_refuses_a_non_loopback_upstream():
    with pytest.raises(ValueError, match="loopback"):
        DelayLine(("192.0.2.1", 80), 0.001)
