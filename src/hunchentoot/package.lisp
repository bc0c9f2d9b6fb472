;;;; package.lisp -- the drop-in names of the GALLOP package (src/package.lisp),
;;;; exported here, by the layer that defines them.

(in-package #:gallop)

(eval-when (:compile-toplevel :load-toplevel :execute)
  (export '(acceptor
            easy-acceptor
            ssl-acceptor
            easy-ssl-acceptor
            taskmaster
            taskmaster-standby-thread-count
            taskmaster-max-queue-length
            taskmaster-engine
            acceptor-reuse-port
            acceptor-activated-socket
            acceptor-streams-body-p
            readiness
            defer-request
            metrics-handler
            create-metrics-dispatcher)
          '#:gallop))
