"""Engine samples from /metrics: parsed from vLLM's text, scraped from running servers."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from bench.simulator.sim import SimConfig, serve
from extproc.core.backends import Backend
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.runtime.pages import PageClient
from extproc.runtime.pool import BackendPool
from extproc.vllm import scraper as scraping
from extproc.vllm.metrics import FAMILIES_PAGE, PAGE, engine_sample
from extproc.vllm.models import MAX_COMMAS, MAX_ENTRIES, listed_adapters
from extproc.vllm.scraper import EngineScraper

VLLM_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
process_start_time_seconds 1.7646e+09
vllm:cache_config_info{block_size="128",cache_dtype="auto",num_gpu_blocks="1024"} 1.0
vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} not-a-number
vllm:request_prompt_tokens_sum{engine="0",model_name="tiny-llama"} 5000.0
vllm:request_prompt_tokens_sum{engine="1",model_name="tiny-llama"} 1200.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 4000.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny-llama"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny-llama"} 1.7646e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 2500.0
"""


def test_a_vllm_page_becomes_one_sample_summed_over_engines():
    sample = engine_sample(VLLM_PAGE)
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_usage) == (3, 4, 0.25)
    assert (sample.start_time, sample.cache_tokens, sample.block_size) == (1.7646e9, 131072, 128)
    assert sample.prompt_tokens == 6200  # finished requests' prompt tokens, not the cache lookups
    assert (sample.cache_queries, sample.cache_hits) == (5000, 2500)  # what the prefix cache found (trust.py)
    assert engine_sample("some_other_exporter 1\n") is None


def test_a_page_an_engine_should_never_write_is_read_without_harm(monkeypatch):
    """Lines no vLLM writes (one of 20 KB; a thousand LoRA or cache-config series of 4,000
    letters, whose labels only one of each is read for, in one pass), values that are not finite
    (NaN, inf), counters past what a float counts exactly or negative, a usage outside 0-1, a
    cache no server has: each is skipped, and the rest of the page stands."""
    from extproc.vllm import metrics

    page = VLLM_PAGE.replace("1.7646e+09", "NaN").replace(
        'num_gpu_blocks="1024"', 'num_gpu_blocks="1' + "0" * 400 + '"'
    )
    page += "vllm:lora_requests_info{" + "a" * 20_000 + "} 1\n"
    page += "".join(f"vllm:lora_requests_info{{{'a' * 4000}}} {i}\n" for i in range(1, 1000))
    page += "".join(f"vllm:cache_config_info{{{'b' * 4000}}} 1\n" for i in range(1000))
    page += "vllm:prefix_cache_hits_total 1e308\nvllm:prefix_cache_hits_total 1e308\n"
    page += "vllm:prefix_cache_queries_total -5\nvllm:kv_cache_usage_perc 1e300\n"
    read: list[str] = []
    labels = metrics._labels
    monkeypatch.setattr(metrics, "_labels", lambda line: read.append(line) or labels(line))
    sample = engine_sample(page)
    assert len(read) == 2 and all(len(line) < 5000 for line in read)  # one series of each family
    assert sample is not None and (sample.running, sample.waiting) == (3, 4)
    assert sample.start_time is None  # NaN: never a "restart" at every scrape
    assert sample.cache_tokens is None and sample.block_size is None  # the first config is not a server's
    assert (sample.cache_hits, sample.cache_queries, sample.kv_usage) == (2500, 5000, 0.25)  # the odd lines skipped
    assert sample.lora_running == () and sample.lora_slots is None
    negative = engine_sample(VLLM_PAGE.replace('block_size="128"', 'block_size="-16"'))
    assert negative is not None and negative.block_size is None
    assert engine_sample("vllm:num_requests_running inf\n") is None


def test_a_page_of_megabytes_is_read_in_slices_with_the_loop_turning_between_them():
    """A LoRA server's page can grow to megabytes; read at once, its 4 MiB bound held the event
    loop some 40 ms. Read a slice of whole lines at a time, it gives the sample a reading at once
    gives, every line counted once wherever the slices fall; a page of the usual size costs no
    extra turn of the loop."""
    filler = "".join(f'vllm:lora_requests_info{{running_lora_adapters="a{i % 7}"}} {i % 5}\n' for i in range(60_000))
    page = (VLLM_PAGE + filler + VLLM_PAGE).encode()
    assert len(page) > 10 * scraping.SLICE_BYTES

    async def read(page: bytes) -> tuple[object, int]:
        turns = 0

        async def turn() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(turn())
        await asyncio.sleep(0)
        turns = 0
        try:
            return await scraping._sample_of(page), turns
        finally:
            ticker.cancel()

    sample, turns = asyncio.run(read(page))
    assert sample == engine_sample(page.decode()) and sample is not None and sample.running == 6
    assert turns >= len(page) // scraping.SLICE_BYTES - 1
    for other in (b"\r\n", b"\r", "\u2028".encode()):  # any break str.splitlines knows, a slice's border too
        crossed = page.replace(b"\n", other)
        sample, turns = asyncio.run(read(crossed))
        assert sample == engine_sample(crossed.decode()) and sample is not None and sample.running == 6
        assert turns >= len(page) // scraping.SLICE_BYTES - 1, other
    assert asyncio.run(read(VLLM_PAGE.encode())) == (engine_sample(VLLM_PAGE), 0)


def test_a_listing_of_more_entries_than_the_adapter_book_keeps_is_not_parsed():
    """Parsing JSON costs the loop about a microsecond a value: a listing of more entries than the
    book keeps twice over, or of more commas than such entries hold, is refused before it is
    parsed; one of that many vLLM entries is read whole."""
    entry = (
        '{"id":"a%d","object":"model","created":1,"owned_by":"vllm","root":"/a","parent":"m","max_model_len":null,'
        '"permission":[{"id":"p","object":"model_permission","created":1,"allow_create_engine":false,'
        '"allow_sampling":true,"allow_logprobs":true,"allow_search_indices":false,"allow_view":true,'
        '"allow_fine_tuning":false,"organization":"*","group":null,"is_blocking":false}]}'
    )

    def listing(entries: int) -> bytes:
        return ('{"object":"list","data":[' + ",".join(entry % i for i in range(entries)) + "]}").encode()

    assert listed_adapters(listing(MAX_ENTRIES)) == [f"a{i}" for i in range(MAX_ENTRIES)]
    assert listed_adapters(listing(MAX_ENTRIES + 1)) is None
    assert listed_adapters(('{"data":[' + ",".join(["1"] * (MAX_COMMAS + 2)) + "]}").encode()) is None
    assert listed_adapters(('{"data":[' + ",".join(["1"] * MAX_COMMAS) + "]}").encode()) == []


async def scrape_once(config: SimConfig, pages: dict[str, str], extra: tuple[str, ...] = ()):
    """One scrape round over a simulated server, a server answering `pages` (path -> text) and
    `extra` addresses: (router, scraper, the simulated server's address, the other's)."""
    runners = await serve([0], config)
    other = web.Application()
    for path, text in pages.items():

        async def page(_request: web.Request, text: str = text) -> web.Response:
            return web.Response(text=text)

        other.router.add_get(path, page)
    stranger = web.AppRunner(other)
    await stranger.setup()
    await web.TCPSite(stranger, "127.0.0.1", 0).start()
    sim = f"127.0.0.1:{runners[0].addresses[0][1]}"
    foreign = f"127.0.0.1:{stranger.addresses[0][1]}"
    router = Router(Settings())
    pool = BackendPool([Backend(a) for a in (sim, foreign, *extra)], router.remove_backend, 1)
    scraper = EngineScraper(router, pool, clock=lambda: 5.0)
    client = PageClient(2.0)
    try:
        await scraper.scrape(client)
    finally:
        client.close()
        for runner in [*runners, stranger]:
            await runner.cleanup()
    return router, scraper, sim, foreign


def test_scraping_running_servers_feeds_load_capacity_and_start_times():
    config = SimConfig(block_size=16, capacity_blocks=300)
    router, scraper, sim, _ = asyncio.run(scrape_once(config, {"/metrics": "not_vllm 1\n"}, ("127.0.0.1:9",)))
    assert scraper.failures == 2  # a page that is not vLLM's, a server that is not there
    assert router.loads.get(sim).engine_at == 5.0
    assert router.state().load[sim].engine_requests == 0
    assert router._kv_tokens == {sim: 300 * 16}
    assert router._starts[sim] > 1.7e9


def test_a_servers_adapters_are_listed_from_the_first_round_and_bad_listings_are_counted():
    # before any request: no LoRA metric yet, the listing already
    config = SimConfig(lora_modules="x,y", max_loras=2)
    pages = {"/metrics": VLLM_PAGE, "/v1/models": "{not json"}
    router, scraper, sim, odd = asyncio.run(scrape_once(config, pages))
    assert router.adapters.state()[sim]["listed"] == ["x", "y"]
    assert router.adapters.adapter_of("x") == "x" and router.adapters.adapter_of("m") is None
    assert odd not in router.adapters.state() and scraper.failures == 1  # its listing was not JSON


def test_each_healthy_backends_sample_age_is_kept_for_a_stale_feed_alert():
    """Seconds since each healthy backend's last good sample: a server that never answers ages from
    the start of scraping, an unhealthy one is left out (the pool routes around it), nothing at all
    is reported while scraping is off."""

    async def scenario() -> tuple[dict[str, float], dict[str, float], str, str]:
        runners = await serve([0], SimConfig())
        sim, silent, down = f"127.0.0.1:{runners[0].addresses[0][1]}", "127.0.0.1:9", "127.0.0.1:11"
        router = Router(Settings())
        pool = BackendPool([Backend(a) for a in (sim, silent, down)], router.remove_backend, 1)
        pool.mark(down, False, confirmed=True)
        now = [100.0]
        scraper = EngineScraper(router, pool, clock=lambda: now[0])
        off = scraper.ages()
        running = asyncio.create_task(scraper.run(0.01))
        try:
            for moment in (100.0, 110.0):  # a good sample at each moment
                now[0] = moment
                for _ in range(500):
                    await asyncio.sleep(0.01)
                    if router.loads.get(sim).engine_at == moment:
                        break
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            for runner in runners:
                await runner.cleanup()
        now[0] = 130.0
        return off, scraper.ages(), sim, silent

    off, ages, sim, silent = asyncio.run(scenario())
    assert off == {} and ages == {sim: 20.0, silent: 30.0}


def test_a_fleet_past_the_rate_is_scraped_a_slice_per_round_and_each_listed_on_its_first_sample():
    async def scenario() -> None:
        runners = await serve([0, 0, 0, 0], SimConfig())
        addresses = [f"127.0.0.1:{r.addresses[0][1]}" for r in runners]
        router = Router(Settings())
        pool = BackendPool([Backend(a) for a in addresses], router.remove_backend, 1)
        now = [5.0]
        scraper = EngineScraper(router, pool, clock=lambda: now[0])
        scraper._started = 0.0  # as `run` sets it
        scraper.rotation.per_round = 2
        listed: list[str] = []
        listings = scraper._listings

        async def counting(client: PageClient, backends: list[str]) -> None:
            listed.extend(backends)
            await listings(client, backends)

        scraper._listings = counting  # type: ignore[method-assign]  # which backends each round lists
        client = PageClient(2.0)
        try:
            await scraper.scrape(client)
            assert scraper.ages() == {addresses[0]: 0.0, addresses[1]: 0.0, addresses[2]: 5.0, addresses[3]: 5.0}
            now[0] = 6.0
            await scraper.scrape(client)
            assert scraper.ages() == {a: 0.0 if a in addresses[2:] else 1.0 for a in addresses}
            await scraper.scrape(client)  # the first two again: not listed again yet
            assert listed == addresses
            pool.mark(addresses[2], False, confirmed=True)  # down (the router forgets its adapters) ...
            await scraper.scrape(client)
            pool.mark(addresses[2], True, confirmed=True)  # ... and back: listed on its first sample again
            await scraper.scrape(client)
            await scraper.scrape(client)
            assert listed == [*addresses, addresses[2]]
        finally:
            client.close()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(scenario())


def test_only_the_families_routing_reads_are_asked_for_and_a_server_without_that_page_is_scraped_whole():
    """vLLM (and the simulator) serve the named families at /metrics/?name[]=...: a twentieth of the
    page. A server answering that page with something else is scraped at /metrics, at once and
    from then on."""

    async def scenario() -> None:
        runners = await serve([0], SimConfig(block_size=16, capacity_blocks=300))
        sim = f"127.0.0.1:{runners[0].addresses[0][1]}"
        hits: dict[str, list[str]] = {}
        whole_only = web.Application()

        async def page(request: web.Request) -> web.Response:
            hits.setdefault(request.host, []).append(request.path)
            return web.Response(text=VLLM_PAGE) if request.path == PAGE else web.Response(status=404)

        whole_only.router.add_get("/metrics", page)
        whole_only.router.add_get("/metrics/", page)
        stranger = web.AppRunner(whole_only)
        await stranger.setup()
        await web.TCPSite(stranger, "127.0.0.1", 0).start()
        old = f"127.0.0.1:{stranger.addresses[0][1]}"
        router = Router(Settings())
        pool = BackendPool([Backend(sim), Backend(old)], router.remove_backend, 1)
        scraper = EngineScraper(router, pool, clock=lambda: 5.0)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                async with session.get(f"http://{sim}{FAMILIES_PAGE}") as response:
                    families = await response.text()
                async with session.get(f"http://{sim}{PAGE}") as response:
                    whole = await response.text()
                assert engine_sample(families) == engine_sample(whole) is not None
                assert "vllm:num_requests_running" in families and len(families) * 3 < len(whole)
            client = PageClient(2.0)
            for _ in range(2):
                await scraper.scrape(client)
            client.close()
        finally:
            for runner in [*runners, stranger]:
                await runner.cleanup()
        assert scraper.failures == 1  # only the old server's listing: it serves no /v1/models
        assert router.state().load[old].engine_requests == 7 and router.loads.get(sim).engine_at == 5.0
        assert hits[old] == ["/metrics/", "/metrics", "/metrics"]  # its 404 for the families: not asked again

    asyncio.run(scenario())


def test_pages_are_asked_for_uncompressed():
    """prometheus_client gzips a page for a client that accepts it: the engine's CPU, and kvroute's
    to undo it, for a few KB on a local network."""

    async def scenario() -> list[str]:
        asked: list[str] = []
        app = web.Application()

        async def page(request: web.Request) -> web.Response:
            asked.append(request.headers.get("Accept-Encoding", ""))
            return web.Response(text=VLLM_PAGE)

        app.router.add_get("/metrics/", page)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        router = Router(Settings())
        pool = BackendPool([Backend(f"127.0.0.1:{runner.addresses[0][1]}")], router.remove_backend, 1)
        running = asyncio.create_task(EngineScraper(router, pool).run(0.01))
        try:
            for _ in range(500):
                await asyncio.sleep(0.01)
                if asked:
                    break
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await runner.cleanup()
        return asked

    assert asyncio.run(scenario())[0] == "identity"
