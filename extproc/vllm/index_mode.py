"""Apply the `index_mode` setting: precise needs the served model's tokenizer, loaded here from
`tokenizer_path`; when it cannot be loaded the router stays approximate and says why, so a bad
path costs precision, never requests."""

from __future__ import annotations

import asyncio
import logging

from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.vllm.tokenizer import ChatTokenizer, TokenizerError

log = logging.getLogger(__name__)


def _load(path: str) -> ChatTokenizer | TokenizerError:
    """The tokenizer in `path`, or why not (returned, so a worker thread hands it back as is)."""
    if not path:
        return TokenizerError("index: precise needs tokenizerPath (tokenizer_path)")
    try:
        return ChatTokenizer(path)
    except TokenizerError as exc:
        return exc


class IndexModeSwitch:
    """The router's current index mode and why."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._path: str | None = None  # the tokenizer directory in use (precise mode)
        self.tokenizer: ChatTokenizer | None = None
        self.status = "approximate"
        self._latest: Settings | None = None  # the settings `follow` was last given
        self._following = asyncio.Lock()

    def apply(self, settings: Settings) -> str | None:
        """Bring the router in line with the settings; a no-op when nothing changed. Returns the
        problem when precise mode was asked for and could not be had, else None. The tokenizer is
        read on the caller's thread: at start, before anything is served (`follow` while routing)."""
        if settings.index_mode != "precise":
            self._approximate()
            return None
        if not self._loads(settings):
            return None
        return self._install(settings, _load(settings.tokenizer_path))

    async def follow(self, settings: Settings) -> str | None:
        """`apply` for a policy's change while routing: the tokenizer is read and checked in a
        worker thread (a large vocabulary's file takes the loop's every stream with it for
        hundreds of milliseconds), the router staying as it was meanwhile; a change that comes
        meanwhile supersedes this one."""
        self._latest = settings
        async with self._following:
            if self._latest is not settings:
                return None
            if not self._loads(settings):
                return self.apply(settings)
            return self._install(settings, await asyncio.to_thread(_load, settings.tokenizer_path))

    def _loads(self, settings: Settings) -> bool:
        """Whether the settings call for a tokenizer not yet in use."""
        return settings.index_mode == "precise" and not (self._router.precise and settings.tokenizer_path == self._path)

    def _approximate(self) -> None:
        self._router.use_approximate()
        self._path, self.tokenizer, self.status = None, None, "approximate"

    def _install(self, settings: Settings, loaded: ChatTokenizer | TokenizerError) -> str | None:
        if isinstance(loaded, TokenizerError):
            self._router.use_approximate()
            self._path, self.tokenizer = None, None
            self.status = f"approximate (precise requested: {loaded})"
            log.error("precise index unavailable, routing approximate: %s", loaded)
            return f"routing approximate: {loaded}"
        self._router.use_precise(loaded)
        self._path, self.tokenizer = settings.tokenizer_path, loaded
        self.status = "precise" if loaded.segmented else "precise (whole-prompt tokenization)"
        log.info("precise index with the tokenizer in %s (%s)", settings.tokenizer_path, self.status)
        return None
