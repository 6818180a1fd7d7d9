// Backward pass (SPEC §3.2): public API. Filled in by the backward work (issue 4).
#pragma once
