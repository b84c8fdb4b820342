"""The mock engine's admission core: a FIFO waiting queue in front of running slots and a KV
cache, as a batching inference server (vLLM) schedules sequences. Pure (no I/O, no clock, no
event loop), so every decision can be tested with plain values; `stargate.mock.engine` does the
waiting.

* A sequence is a ticket (an int chosen by the caller) and the KV tokens it reserves (its prompt
  plus every token it will generate), reserved whole when it is admitted and released when it
  leaves. There is no preemption: what is running keeps running.
* Admission is strictly FIFO: the head of the waiting queue is admitted once a slot is free
  (`max_num_seqs`, 0 = unlimited) and its reservation fits in the free KV cache
  (`kv_cache_tokens`, 0 = unlimited); until then it blocks everything behind it, even
  sequences that would fit. Head-of-line blocking is what a strict FIFO engine does, and it
  keeps the order of service equal to the order of arrival, which the tests rely on.
* Invariant after every call: the head of the queue (if any) cannot be admitted. So `submit`
  can admit only the submitted ticket, and the calls that free room (`leave`,
  `set_max_num_seqs`) return every ticket they admitted, in order, for the caller to wake.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Scheduler"]


class Scheduler:
    """FIFO admission of sequences into `max_num_seqs` slots and `kv_cache_tokens` of KV cache
    (0 = unlimited for either)."""

    def __init__(self, max_num_seqs: int = 0, kv_cache_tokens: int = 0) -> None:
        if max_num_seqs < 0:
            raise ValueError("max_num_seqs must be non-negative")
        if kv_cache_tokens < 0:
            raise ValueError("kv_cache_tokens must be non-negative")
        self._max_num_seqs = max_num_seqs
        self._capacity = kv_cache_tokens
        self._running: dict[int, int] = {}  # ticket -> reserved tokens
        self._waiting: OrderedDict[int, int] = OrderedDict()  # arrival order
        self._kv_used = 0

    # ---------------------------------------------------------------- state

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def kv_cache_tokens(self) -> int:
        """The KV capacity in tokens (0 = unlimited)."""
        return self._capacity

    @property
    def kv_used(self) -> int:
        """Tokens reserved by the running sequences."""
        return self._kv_used

    @property
    def kv_free(self) -> int | None:
        """Tokens the running sequences leave free, or None when the KV cache is unlimited."""
        return self._capacity - self._kv_used if self._capacity else None

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def is_running(self, ticket: int) -> bool:
        return ticket in self._running

    def is_waiting(self, ticket: int) -> bool:
        return ticket in self._waiting

    def fits_at_all(self, tokens: int) -> bool:
        """Whether a reservation of `tokens` could ever be admitted (it fits the whole cache)."""
        return self._capacity == 0 or tokens <= self._capacity

    def can_admit_now(self, tokens: int) -> bool:
        """Whether a sequence reserving `tokens` submitted now would be admitted at once."""
        return not self._waiting and self._has_room(tokens)

    # ---------------------------------------------------------------- changes

    def submit(self, ticket: int, tokens: int) -> bool:
        """Queue `ticket`, reserving `tokens` once admitted; True if it was admitted at once.

        Raises ValueError for a ticket already known, a negative reservation, or one larger than
        the whole KV cache (it would block the queue forever; `fits_at_all` checks first).
        """
        if ticket in self._running or ticket in self._waiting:
            raise ValueError(f"ticket {ticket} is already scheduled")
        if tokens < 0:
            raise ValueError("a reservation must be non-negative")
        if not self.fits_at_all(tokens):
            raise ValueError(f"{tokens} tokens exceed the KV cache of {self._capacity}")
        if not self._waiting and self._has_room(tokens):
            self._running[ticket] = tokens
            self._kv_used += tokens
            return True
        # By the invariant, a non-empty queue's head cannot run, so neither can this ticket.
        self._waiting[ticket] = tokens
        return False

    def leave(self, ticket: int) -> list[int]:
        """`ticket` is done (finished or cancelled, running or still waiting): release its slot
        and KV reservation, or take it out of the queue. Returns the tickets this admitted, in
        order. Unknown tickets are ignored, so leaving twice is harmless."""
        tokens = self._running.pop(ticket, None)
        if tokens is not None:
            self._kv_used -= tokens
        elif self._waiting.pop(ticket, None) is None:
            return []
        return self._admit() if self._waiting else []

    def set_max_num_seqs(self, max_num_seqs: int) -> list[int]:
        """Change the slot count; returns the tickets a higher count admitted. A lower count
        preempts nothing: the running sequences finish and the queue waits until fewer run."""
        if max_num_seqs < 0:
            raise ValueError("max_num_seqs must be non-negative")
        self._max_num_seqs = max_num_seqs
        return self._admit()

    # ---------------------------------------------------------------- internals

    def _has_room(self, tokens: int) -> bool:
        slots = self._max_num_seqs == 0 or len(self._running) < self._max_num_seqs
        return slots and (self._capacity == 0 or self._kv_used + tokens <= self._capacity)

    def _admit(self) -> list[int]:
        admitted: list[int] = []
        waiting = self._waiting
        while waiting:
            ticket, tokens = next(iter(waiting.items()))
            if not self._has_room(tokens):
                break
            del waiting[ticket]
            self._running[ticket] = tokens
            self._kv_used += tokens
            admitted.append(ticket)
        return admitted
