// Forwards to tests/support/errors.hh (catch_error, error_of), for the suites that still include it
// from here.
#pragma once

#include "support/errors.hh"
