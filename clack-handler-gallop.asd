;;;; clack-handler-gallop.asd -- Gallop as a Clack server:
;;;;   (clack:clackup app :server :gallop :port 4242)
;;;; Older Clack finds this system by the name clack-handler-<server>; newer
;;;; Clack asks for clack.handler.<server>, which clack.handler.gallop.asd
;;;; defines as this system.

(defsystem "clack-handler-gallop"
  :description "Clack handler for Gallop's native app API."
  :version "0.1.0"
  :license "BSD-2-Clause"
  :depends-on ("gallop/native" "clack-socket")
  :components ((:file "src/clack/handler")))
