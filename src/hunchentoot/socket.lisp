;;;; socket.lisp -- the usocket that Hunchentoot's PROCESS-CONNECTION sees for
;;;; a connection Gallop serves.
;;;;
;;;; PROCESS-CONNECTION takes a usocket: it reads USOCKET:SOCKET-STREAM and asks
;;;; for the peer and local names.  A CONNECTION-USOCKET answers from what
;;;; accept returned (Gallop's accept4(2), or Hunchentoot's own accept on a
;;;; stock acceptor), so no getpeername(2) per request, none that fails for a
;;;; client that already hung up, and its stream is the Gallop connection
;;;; itself.

(in-package #:gallop)

(defclass connection-usocket (usocket:stream-usocket)
  ((connection :initarg :connection :reader usocket-connection)
   (deferred :initform nil :accessor usocket-deferred
             :documentation "The request deferred on this connection (defer.lisp), or NIL.")
   (peer-names :initform nil :accessor usocket-peer-names
               :documentation "Hunchentoot's (address-string port) of the peer, once
asked (request-loop.lisp), or NIL.")
   (local-names :initform nil :accessor usocket-local-names
                :documentation "Hunchentoot's (address-string port) of this end, once
asked (request-loop.lisp), or NIL."))
  (:documentation "A usocket view of a Gallop connection."))

(defun connection-deferred (c)
  "The request deferred on the Gallop connection C (defer.lisp), or NIL."
  (let ((socket (connection-user-data c)))
    (and (typep socket 'connection-usocket) (usocket-deferred socket))))

(defun make-connection-usocket (connection)
  (make-instance 'connection-usocket :socket nil :stream connection
                                     :connection connection))

(defmethod usocket:get-peer-name ((socket connection-usocket))
  (let ((c (usocket-connection socket)))
    (values (connection-remote-address c) (connection-remote-port c))))

(defmethod usocket:get-peer-address ((socket connection-usocket))
  (connection-remote-address (usocket-connection socket)))

(defmethod usocket:get-peer-port ((socket connection-usocket))
  (connection-remote-port (usocket-connection socket)))

(defmethod usocket:get-local-name ((socket connection-usocket))
  (let ((c (usocket-connection socket)))
    (values (connection-local-address c) (connection-local-port c))))

(defmethod usocket:get-local-address ((socket connection-usocket))
  (connection-local-address (usocket-connection socket)))

(defmethod usocket:get-local-port ((socket connection-usocket))
  (connection-local-port (usocket-connection socket)))

(defmethod usocket:socket-close ((socket connection-usocket))
  (close (usocket-connection socket)))
