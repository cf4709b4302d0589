// plan_error: the message of the PlanError a callable throws, for the tests of errors users
// can hit.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>

#include "analysis/placement.h"

namespace autosp {

// The message of the PlanError that `fn` throws ("" and a test failure if it throws none or
// another exception).
inline std::string plan_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const PlanError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a PlanError, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected a PlanError, nothing was thrown";
  return "";
}

}  // namespace autosp
