// Forwards to tests/support/env_scope.hh (ScopedEnvironment), for the suites that still include it
// from here.
#pragma once

#include "support/env_scope.hh"
