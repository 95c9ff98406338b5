-- The restart guard's startup mark on a node of a new deployment (every node answered, none
-- marked): trusted at once, with the marker's time the node's own clock, when its data began
-- as far as anyone knows, so the fence floor stays (never 0: review rio2, 1).
-- KEYS: node marker. Returns nothing; a marker already there is left as it is.
--! include _hold
local marker, guard = KEYS[1], 0
local now = now_ms()

--! include _restart_guard

data_since(true)
