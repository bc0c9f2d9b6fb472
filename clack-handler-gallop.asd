;;;; clack-handler-gallop.asd -- Gallop as a Clack server:
;;;;   (clack:clackup app :server :gallop :port 4242)
;;;; Clack finds this system by the name clack-handler-<server>.

(defsystem "clack-handler-gallop"
  :description "Clack handler for Gallop's native app API."
  :version "0.1.0"
  :license "BSD-2-Clause"
  :depends-on ("gallop/native")
  :components ((:file "src/clack/handler")))
