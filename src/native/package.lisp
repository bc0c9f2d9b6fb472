;;;; package.lisp -- the GALLOP package: the native app API (system
;;;; gallop/native, no Hunchentoot needed) and the drop-in Hunchentoot classes
;;;; (system gallop).

(defpackage #:gallop
  (:use #:common-lisp)
  (:import-from #:gallop.core
                #:connection #:connection-mark-boundary #:connection-owner-stream
                #:connection-user-data #:connection-remote-address
                #:connection-remote-port #:connection-local-address
                #:connection-local-port)
  (:import-from #:gallop.core #:handler-timeout)
  (:export
   ;; signalled in a handler that ran past its deadline (:HANDLER-TIMEOUT)
   #:handler-timeout
   ;; native app API (Clack convention)
   #:start
   #:stop
   #:server
   #:server-port
   #:server-address
   ;; drop-in Hunchentoot classes
   #:acceptor
   #:easy-acceptor
   #:ssl-acceptor
   #:easy-ssl-acceptor
   #:taskmaster
   #:taskmaster-standby-thread-count
   #:taskmaster-max-queue-length
   #:taskmaster-engine
   ;; both
   #:stats))
