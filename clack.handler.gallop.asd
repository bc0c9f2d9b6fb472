;;;; clack.handler.gallop.asd -- the Clack handler under the name Clack (Lack)
;;;; asks ASDF for: clack.handler.<server>.  ASDF finds a system in
;;;; *central-registry* by its primary name, so this file must be named
;;;; exactly after it.  The system only depends on clack-handler-gallop (the
;;;; name older Clack loads), so both names load the same one component and
;;;; loading both compiles and loads src/clack/handler.lisp once.

(defsystem "clack.handler.gallop"
  :description "Clack handler for Gallop's native app API (the name Clack looks up)."
  :version "0.1.0"
  :license "BSD-2-Clause"
  :depends-on ("clack-handler-gallop"))
