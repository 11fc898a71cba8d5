"""Apply the `index_mode` setting: precise needs the served model's tokenizer, loaded here from
`tokenizer_path`; when it cannot be loaded the router stays approximate and says why, so a bad
path costs precision, never requests."""

from __future__ import annotations

import logging

from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.vllm.tokenizer import ChatTokenizer, TokenizerError

log = logging.getLogger(__name__)


class IndexModeSwitch:
    """The router's current index mode and why."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._path: str | None = None  # the tokenizer directory in use (precise mode)
        self.tokenizer: ChatTokenizer | None = None
        self.status = "approximate"

    def apply(self, settings: Settings) -> str | None:
        """Bring the router in line with the settings; a no-op when nothing changed. Returns the
        problem when precise mode was asked for and could not be had, else None."""
        if settings.index_mode != "precise":
            self._router.use_approximate()
            self._path, self.tokenizer, self.status = None, None, "approximate"
            return None
        if self._router.precise and settings.tokenizer_path == self._path:
            return None
        try:
            if not settings.tokenizer_path:
                raise TokenizerError("index: precise needs tokenizerPath (tokenizer_path)")
            tokenizer = ChatTokenizer(settings.tokenizer_path)
        except TokenizerError as exc:
            self._router.use_approximate()
            self._path, self.tokenizer = None, None
            self.status = f"approximate (precise requested: {exc})"
            log.error("precise index unavailable, routing approximate: %s", exc)
            return f"routing approximate: {exc}"
        self._router.use_precise(tokenizer)
        self._path, self.tokenizer = settings.tokenizer_path, tokenizer
        self.status = "precise" if tokenizer.segmented else "precise (whole-prompt tokenization)"
        log.info("precise index with the tokenizer in %s (%s)", settings.tokenizer_path, self.status)
        return None
