// Process liveness checks used to turn a dead peer into a clean failure instead of a hang.
#pragma once

#include <sys/types.h>

#include <string>

namespace ringserve {

// False when `pid` does not exist or is a zombie/dead task (its /proc/<pid>/stat state is Z or X).
// A pid reused by an unrelated process reads as alive; callers accept that rare false positive.
bool is_process_alive(pid_t pid);

// How a child of this process that has exited ended ("signal 9", "exit code 1"), without reaping it (its parent
// still waits for it); "" when `pid` is not an exited child of this process.
std::string describe_child_exit(pid_t pid);

}  // namespace ringserve
