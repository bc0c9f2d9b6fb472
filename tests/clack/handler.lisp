;;;; handler.lisp -- the Clack handler, called the way Clack calls it:
;;;; (apply #'clack.handler.gallop:run app :allow-other-keys t options) in a
;;;; thread, stopped by destroying that thread.

(in-package #:gallop-tests)

(in-suite native)

(test clack-handler-runs-and-stops-as-clack-does
  (asdf:load-system "clack-handler-gallop")
  (let* ((run (find-symbol "RUN" "CLACK.HANDLER.GALLOP"))
         (port (let ((s (usocket:socket-listen "127.0.0.1" 0)))
                 (prog1 (usocket:get-local-port s) (usocket:socket-close s))))
         (threads (thread-count))
         (app (lambda (env)
                (list 200 '(:content-type "text/plain")
                      (list (format nil "clack ~A" (getf env :path-info))))))
         (thread (sb-thread:make-thread
                  (lambda ()
                    (funcall run app :port port :address "127.0.0.1" :debug nil
                                     :use-thread t :use-default-middlewares nil
                                     :allow-other-keys t))
                  :name "clack-handler")))
    (is (wait-until (lambda () (ignore-errors (get-request port "/x")))))
    (let ((r (get-request port "/hello")))
      (is (= 200 (response-status r)))
      (is (string= "clack /hello" (body-string r))))
    ;; Clack's STOP: destroy the handler thread.
    (sb-thread:terminate-thread thread)
    (sb-thread:join-thread thread :default nil)
    (is (wait-until (lambda () (= threads (thread-count)))))
    ;; the port is free again
    (let ((s (usocket:socket-listen "127.0.0.1" port :reuse-address t)))
      (is (= port (usocket:get-local-port s)))
      (usocket:socket-close s))))
