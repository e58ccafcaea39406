"""One module per option, or per mcore feature the hooks must follow (packed batches, deferred weight gradients, a
later stage's tied embeddings): its attach-time check, its per-forward state and its code at each hook site.

The switchboard (``hooks``) and the check phase (``preflight``) call these modules statically, in a
fixed order; none of them imports ``hooks``, ``handle`` or ``api``, and the shared mechanics they
use (the forward, its window and swaps, call arguments, proxies) are in ``runtime``, which names no
option. A module may implement these verbs, and nothing else is called on it:

``check(model, options) -> None``
    At ``attach``, from ``preflight.check``, before anything is built or registered: refuse what
    the option cannot run on ``model`` (as ``attach`` was given it: a wrapper, or the language
    model; ``models.find_language_model``) with an ``MTPHooksError``. Changes nothing.
Per-model state
    Built from the language model and the options in ``ForwardHooks.__init__`` (``chain.Plan``,
    ``tied_copy.Mark``); whatever it changed on the model is undone in ``ForwardHooks.close`` (at
    ``remove``). A copy of the hooked model (``deepcopy``, ``pickle``) copies it as plain data unless
    its class says otherwise.
Per-forward state
    One small dataclass with defaults (``mtp_loss.Losses``, ``chain.ChainCall``,
    ``logprobs.Scoring``, ``deferral.MainCall``, ``packing.Packing``, ``tied_copy.Served``): a field
    of ``hooks.InFlight``, made with each forward and dropped with it.
Site calls
    Functions named for what they do at one hook site, called by that site's hook in ``hooks`` only
    for the forward in flight on the calling thread, with the options, the forward (``Forward``),
    the module's own per-forward state and the call's arguments. A pre-hook's call may rewrite the
    call's ``kwargs`` in place or return a ``runtime.arguments.HookResult``; a change to a submodule
    goes through ``Forward.swap`` (undone when the MTP block returns or the window closes).

The sites, in a forward's order, and who acts there:

* model pre-hook (every forward, before mcore runs): ``mtp_loss.forward_scale``, ``logprobs.begin``,
  the call's ``packed_seq_params`` into ``Packing``;
* decoder post-hook (an inference forward opens its window): ``tied_copy.served`` / ``keep``;
* MTP block pre-hook (a training forward): ``packing.on_block_pre``;
* MTP layer pre-hooks (registered where an option rewrites the layers' arguments, ``layer_keywords``):
  ``chain.feed_draft``, ``mtp_input.on_layer_pre``, ``start_embedding.on_layer_pre``, then ``detach.on_layer_pre``;
  the step layer's first pre-hook and post-hook: ``chain.record_call`` / ``record_output``;
* MTP block post-hook (the training window opens): ``chain.extend``;
* output layer pre-hook, the main head's call: ``tied_copy.serve``, ``detach.mtp_head``,
  ``mtp_loss.attach``, ``deferral.undefer_main_call``, ``logprobs.score``; its post-hook:
  ``deferral.end_main_call``, ``logprobs.on_head_post``;
* model post-hook kept last (the forward completed): ``mtp_loss.check_finished``, ``mtp_loss.count``.

A new option: a field of ``options.Options`` and a keyword of ``api.attach``; a module here with
the verbs it needs; one line in ``preflight`` for its check, a field of ``hooks.InFlight`` for its
state and one call at each site it acts at (with the hook's registration in ``install`` if the site
has none yet).
"""

from mtp_hooks.features import detach, mtp_input, start_embedding  # noqa: E402  (after the docstring's map)
from mtp_hooks.options import Options  # noqa: E402


def layer_keywords(options: Options) -> tuple[str, ...]:
    """The MTP layers' keyword arguments the options rewrite in their pre-hooks (checked against the release at
    ``attach``; empty: no option acts there but the chain's own drafts)."""
    return tuple(dict.fromkeys(detach.layer_keywords(options) + mtp_input.layer_keywords(options)
                               + start_embedding.layer_keywords(options)))
