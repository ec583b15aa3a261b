"""Flow control (llm-d-router's, behind ``featureGates: [flowControl]``): requests queue per flow and
priority band while the pool is saturated, instead of being rejected at once.

:mod:`.key` reads the flow key from headers; :mod:`.config` the ``flowControl:`` section and
its policy and detector plugins; :mod:`.queue` is the sans-IO queue and dispatch logic the Trio
shell waits on.
"""
